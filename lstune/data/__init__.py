"""The data layer: from a `--data` source to batches of pre-shifted, full-length samples.

- `sources`: resolve the source string (local file/folder, save_to_disk folder, builtin:, hub).
- `records`: detect the record kind (text / messages / input_ids), tokenize, shift labels once.
- `dataset`: `build_dataset(...) -> LongContextDataset` (long-sample or packed mode, summary).
- `loader`: `make_dataloader(...)`, the infinite, seeded, resumable stream of batches.
- `tokenizer`: `ByteTokenizer`, the byte-level tokenizer of the tiny presets and demos.
- `synthetic`: `passkey_records`, the bundled long-context demo task.

Nothing is imported here so that importing `lstune.data` stays free of torch and datasets.
"""
