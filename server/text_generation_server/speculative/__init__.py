"""Speculation: drafting tokens cheaply and keeping only those the full model would choose.

- `controller`: per cycle, which drafter each row uses and how many drafts (and `SpeculateConfig`);
- `cost_model`: draft and verify costs measured on the loaded runner;
- drafters: `ngram` (copies from the request's context) and the layer-skip draft model, a view of
  the runner with skipped layers and a reduced head (`draft_head`);
- `accept`: drafting a token and accepting drafts against the full model's logits;
- `state`: a speculating request's drafters and statistics.
It imports the model stage (runners) and token choice; the engine drives it.
"""
