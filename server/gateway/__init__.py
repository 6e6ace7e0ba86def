"""`pagefleet gateway`: one OpenAI endpoint in front of every pagefleet replica.

The gateway tokenizes each prompt as the servers do, computes the engine's own
block-hash chain, and routes to the replica that already holds the longest prefix,
within a load bound; it splits long and short requests by context fit, splits canary
traffic by weight, queues and admits requests (queue cap, rate limits, priority,
queue-time limit), and holds requests for a model with no ready replica. Layout:

    config.py      GatewayConfig: every flag, one dataclass (the CLI is built from it)
    fleet.py       typed models -> pools -> endpoints; the static YAML file's parser
    discovery.py   where the fleet comes from: a static file (reloaded on change)
    kube.py        ... or Kubernetes: ModelDeployments and their ready pods, watched
    prefix.py      pure: a prompt's block-hash chain, and what each replica holds
    ring.py        pure: consistent-hash ring of a pool's replicas
    routing.py     pure: pool choice (context fit, weights), replica choice
    admission.py   pure: queue admission with priorities, token buckets, API keys
    health.py      pure: 3-strikes health state; scrape parser for /metrics
    state.py       runtime state of models, pools and endpoints
    prompt.py      request body -> model, prompt token ids, max_tokens, priority
    dispatch.py    per-model waiting queue: holds, times out, dispatches in order
    prober.py      per-endpoint /health + /metrics loop
    proxy.py       the upstream call: retry before the first byte, streaming relay
    metrics.py     the gateway's Prometheus metrics (waiting count per model, ...)
    app.py         the ASGI app and the Gateway object that wires it all
    serve.py       `pagefleet gateway` entry: uvicorn, signals
"""
