{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "pagefleet.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped name of the operator's objects. */}}
{{- define "pagefleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s-operator" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Release-scoped name of the gateway's objects. */}}
{{- define "pagefleet.gatewayName" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- printf "%s-gateway" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s-gateway" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagefleet.gatewaySelectorLabels" -}}
app.kubernetes.io/name: {{ include "pagefleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end -}}

{{- define "pagefleet.gatewayLabels" -}}
{{ include "pagefleet.gatewaySelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The namespace the gateway serves: gateway.namespace, else the only one of
operator.watchNamespaces, else all ('*'). */}}
{{- define "pagefleet.gatewayNamespace" -}}
{{- if .Values.gateway.namespace -}}
{{- .Values.gateway.namespace -}}
{{- else if eq (len .Values.operator.watchNamespaces) 1 -}}
{{- first .Values.operator.watchNamespaces -}}
{{- else -}}
*
{{- end -}}
{{- end -}}

{{/* An image reference from (list repository tag digest appVersion): repo:tag, or with
a digest repo@digest (repo:tag@digest when a tag is given too). */}}
{{- define "pagefleet.imageRef" -}}
{{- $repo := index . 0 -}}{{- $tag := index . 1 -}}{{- $digest := index . 2 -}}
{{- if and $digest $tag -}}
{{- printf "%s:%s@%s" $repo $tag $digest -}}
{{- else if $digest -}}
{{- printf "%s@%s" $repo $digest -}}
{{- else -}}
{{- printf "%s:%s" $repo ($tag | default (index . 3)) -}}
{{- end -}}
{{- end -}}

{{- define "pagefleet.gatewayImage" -}}
{{- $gw := .Values.gateway.image -}}
{{- $repo := $gw.repository | default .Values.serverImage.repository -}}
{{- $tag := $gw.tag | default .Values.serverImage.tag -}}
{{- $digest := $gw.digest -}}
{{- if not (or $gw.repository $gw.tag $gw.digest) -}}
{{- $digest = .Values.serverImage.digest -}}
{{- end -}}
{{- include "pagefleet.imageRef" (list $repo $tag $digest .Chart.AppVersion) -}}
{{- end -}}

{{- define "pagefleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagefleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "pagefleet.labels" -}}
{{ include "pagefleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Labels of monitoring objects (not operator pods: no component=operator). */}}
{{- define "pagefleet.monitoringLabels" -}}
app.kubernetes.io/name: {{ include "pagefleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: monitoring
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "pagefleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pagefleet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create=false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pagefleet.image" -}}
{{- include "pagefleet.imageRef" (list .Values.image.repository .Values.image.tag .Values.image.digest .Chart.AppVersion) -}}
{{- end -}}

{{- define "pagefleet.serverImage" -}}
{{- include "pagefleet.imageRef" (list .Values.serverImage.repository .Values.serverImage.tag .Values.serverImage.digest .Chart.AppVersion) -}}
{{- end -}}

{{/* Namespace patterns (globs) in operator.watchNamespaces: kopf then scans. */}}
{{- define "pagefleet.hasGlobs" -}}
{{- range .Values.operator.watchNamespaces -}}{{- if contains "*" . -}}true{{- end -}}{{- end -}}
{{- end -}}

{{/* Fail early on combinations the schema cannot express. */}}
{{- define "pagefleet.validate" -}}
{{- if and .Values.rbac.namespaced (not .Values.operator.watchNamespaces) -}}
{{- fail "rbac.namespaced=true needs operator.watchNamespaces (the namespaces to create Roles in)" -}}
{{- end -}}
{{- if .Values.rbac.namespaced -}}
{{- range .Values.operator.watchNamespaces -}}
{{- if contains "*" . -}}
{{- fail (printf "rbac.namespaced=true needs exact namespace names, not the pattern %q (a Role cannot be created in it)" .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (gt (int .Values.operator.replicas) 1) (not .Values.peering.enabled) -}}
{{- fail "operator.replicas > 1 needs peering.enabled=true (otherwise every replica acts)" -}}
{{- end -}}
{{- if gt (int .Values.operator.replicas) 1 -}}
{{- range .Values.operator.extraArgs -}}
{{- if and (hasPrefix "--priority" .) (ne . "--priority=auto") -}}
{{- fail (printf "operator.extraArgs %q with operator.replicas > 1: every replica would get the same priority, and kopf pauses all operators on a tie; leave --priority out (each replica then gets its own)" .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if .Values.gateway.enabled -}}
{{- if and (not .Values.gateway.namespace) (gt (len .Values.operator.watchNamespaces) 1) -}}
{{- fail "gateway.enabled=true with several operator.watchNamespaces needs gateway.namespace: the gateway serves one namespace, or all ('*')" -}}
{{- end -}}
{{- $gwns := include "pagefleet.gatewayNamespace" . -}}
{{- if and (ne $gwns "*") (contains "*" $gwns) -}}
{{- fail (printf "gateway.namespace %q: one namespace name, or '*' for all" $gwns) -}}
{{- end -}}
{{- if and .Values.rbac.namespaced (eq $gwns "*") -}}
{{- fail "rbac.namespaced=true with gateway.enabled=true needs gateway.namespace (a namespace name: a Role cannot cover all namespaces)" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.networkPolicy.enabled (not (or .Values.networkPolicy.namespaces .Values.operator.watchNamespaces)) -}}
{{- fail "networkPolicy.enabled=true needs networkPolicy.namespaces (or operator.watchNamespaces): the namespaces of the model servers" -}}
{{- end -}}
{{- if and .Values.networkPolicy.enabled (not .Values.networkPolicy.namespaces) (include "pagefleet.hasGlobs" .) -}}
{{- fail (printf "networkPolicy.enabled=true with a pattern in operator.watchNamespaces (%s) needs networkPolicy.namespaces: the exact namespaces of the model servers (a NetworkPolicy lives in one namespace)" (join ", " .Values.operator.watchNamespaces)) -}}
{{- end -}}
{{- end -}}

{{/*
RBAC rules for namespaced resources: exactly the calls the operator makes
(operator/controller.py, operator/handlers.py) and kopf makes for it. No wildcards.
See docs/deploy.md for the reason of each rule.
*/}}
{{- define "pagefleet.namespacedRules" -}}
# kopf: list+watch the ModelDeployments, patch them (finalizer, progress annotations);
# controller.reconcile(fresh=True) reads one anew before a reconcile it triggers itself.
- apiGroups: ["pagefleet.dev"]
  resources: ["modeldeployments"]
  verbs: ["get", "list", "watch", "patch"]
# controller.write_status: status subresource.
- apiGroups: ["pagefleet.dev"]
  resources: ["modeldeployments/status"]
  verbs: ["patch"]
# resources.owner_references sets blockOwnerDeletion: with the
# OwnerReferencesPermissionEnforcement admission plugin (on by default in OpenShift)
# that needs update on the owner's finalizers, or every child create is refused.
- apiGroups: ["pagefleet.dev"]
  resources: ["modeldeployments/finalizers"]
  verbs: ["update"]
# controller.apply / cleanup / evaluate (scale), and the watches that repair drift.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The pod cache: the server pods to scrape and their OOM exits.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# controller.cache_access_modes: the model cache PVC's access modes (rollout strategy).
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get"]
# Events on ModelDeployments (scales, invalid specs, OOM remediation; kopf's warnings).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if .Values.rbac.inferencePools }}
# controller.sync_inference_pools: the InferencePools of spec.gateway.inferencePool
# (only when the Gateway API Inference Extension CRD is installed).
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "create", "patch", "delete"]
{{- end }}
{{- end -}}

{{- define "pagefleet.peeringRules" -}}
{{- if .Values.peering.enabled }}
# kopf peering: handlers.ensure_peering gets/creates the object, kopf watches it and
# patches its own presence into it.
- apiGroups: ["kopf.dev"]
  resources: [{{ if .Values.operator.watchNamespaces }}"kopfpeerings"{{ else }}"clusterkopfpeerings"{{ end }}]
  verbs: ["get", "list", "watch", "create", "patch"]
{{- end }}
{{- end -}}

{{/* Cluster-scoped reads kopf needs when it scans: all namespaces, or globs. */}}
{{- define "pagefleet.clusterRules" -}}
{{- if or (not .Values.operator.watchNamespaces) (include "pagefleet.hasGlobs" .) }}
# kopf: observe CRDs (discovery of the ModelDeployment resource as it appears).
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end }}
{{- if include "pagefleet.hasGlobs" . }}
# kopf: resolve the namespace patterns (team-*).
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end -}}
