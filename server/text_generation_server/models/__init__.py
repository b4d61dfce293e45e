"""The model stage: weights loaded with a strategy (`loading`), the shipped policy that matches them
(`shipped_policies`), and the runners with their CPU kernels (`runner/`).

Nothing here knows about batches or requests: the engine drives a runner, the speculative
package asks it for draft-model views.
"""
