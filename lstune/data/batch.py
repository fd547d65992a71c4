"""The batch contract every layer reads: `input_ids`, `position_ids` (restarting at 0 at each packed document) and
pre-shifted `shift_labels` (`shift_labels[t]` is the target of token t), whose ignored positions — a document's
last token, prompts, padding — hold `IGNORE_INDEX`, PyTorch's cross-entropy default and Hugging Face's convention.
Defined here once; nothing is imported, so any layer above `data` may read it."""

IGNORE_INDEX = -100
