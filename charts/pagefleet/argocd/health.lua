-- Argo CD health check for pagefleet.dev/ModelDeployment.
-- Install it in argocd-cm under
--   resource.customizations.health.pagefleet.dev_ModelDeployment
-- (docs/deploy.md shows the snippet). It reads the conditions the operator writes
-- (operator/status.py): Stalled and Degraded first, then whether the current
-- generation was applied (status.observedGeneration), then Ready.
local hs = {}

local function condition(kind)
  if obj.status == nil or obj.status.conditions == nil then
    return nil
  end
  for _, c in ipairs(obj.status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function say(c, fallback)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return c.message
  end
  return fallback
end

if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the pagefleet operator to report"
  return hs
end

local stalled = condition("Stalled")
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = say(stalled, stalled.reason or "Stalled")
  return hs
end

local degraded = condition("Degraded")
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = say(degraded, degraded.reason or "Degraded")
  return hs
end

local generation = obj.metadata ~= nil and obj.metadata.generation or nil
if generation ~= nil and (obj.status.observedGeneration == nil or obj.status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Applying generation " .. tostring(generation)
  return hs
end

local ready = condition("Ready")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = say(ready, "Ready")
  return hs
end

hs.status = "Progressing"
hs.message = say(ready, "Rolling out")
return hs
