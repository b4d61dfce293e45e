"""The engine: batches, plan groups, the KV of each group, and the step that runs them.

A step reads plan -> forward -> choose -> stop (`causal_lm.CausalLM.generate_token`): the skip
planner plans new requests (`skip_planner`, with lossy mode's audit in `audit_check`), the rows
that bypass the same layers form a plan group (`plan_groups`), each group steps plainly or in a
draft-verify cycle (`group_step`), and `batch_cache` keeps batches between calls. It imports the
model stage (`models/`), token choice (`sampling/`) and speculation (`speculative/`); none of
them imports it.
"""

from .build import get_model

__all__ = ["get_model"]
