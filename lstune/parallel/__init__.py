"""Sequence parallelism (Ulysses), the SP data adapter and loss, the DeepSpeed engine and the launcher.

Import the submodules directly (`lstune.parallel.dims`, `.ulysses`, `.sp_data`, `.loss`, `.engine_ds`,
`.export`, `.launch`); this package imports nothing heavy so the CLI can load fast. See docs/parallel.md.
"""
