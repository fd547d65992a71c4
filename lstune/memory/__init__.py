"""Single-device memory techniques: sequence-tiled compute (tiled MLP, mini-sequence, tiled loss),
activation checkpointing with host offload, and allocator settings.

Entry points: `lstune.memory.apply.apply_memory_techniques` (patch a loaded model, reversibly),
`lstune.memory.loss.causal_lm_loss_sum` (summed token loss and count for a batch) and
`lstune.memory.allocator.ensure_expandable_segments`. See docs/memory.md. Submodules import torch;
this package file does not, so the CLI can import it at startup.
"""
