"""The `z train` recipe: a small GPT trained on Shakespeare's plays.

Modules, each importable alone (the engine itself lives in `zcore`):
`data` (corpus, splits, token windows), `tokenizer` (byte-level BPE),
`gpt` (the model), `generate` (sampling, export directory), `metrics`
(JSON Lines, loss-curve PNG), `progress` (live progress line). A run:
`train_options` (the flags) -> `train_plan` (checked once, with the engine config of
`train_config`) -> `trainer` (ranks, data, engine on one rank) -> `train` (the loop).
"""
