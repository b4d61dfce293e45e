"""Layer skipping for upstream TGI's Python shard (the official image, TGI 3.3.x).

Design note. Upstream's launcher passes no new flags, so the patch is configured by
environment variables (see config.py) and activated at interpreter start by a .pth line that
only installs an import hook (boot.py). When upstream's shard imports
`text_generation_server.models.causal_lm`, the hook checks that the upstream code is a version
this patch was written against (compat.py), then wraps `CausalLM.generate_token` (runtime.py):

    plan new requests at prefill (our layerskip detector -> decider, one SkipPlan per request)
    -> upstream's own generate_token runs, with forward hooks on the decoder layers that pass
       each bypassed row's hidden state through unchanged (lossy) or do nothing (shadow)
    -> count the bypasses per request, report plans and counts, drop finished requests' plans

No upstream code is copied or edited. Upstream's padded CausalLM keeps one KV tensor per layer
for the whole batch (its filter/concatenate index those tensors), so a bypassed layer still
runs for the batch and only its output rows are replaced: the output is exactly that of
skipping, but no compute or KV memory is saved. Our own image skips for real.
"""
