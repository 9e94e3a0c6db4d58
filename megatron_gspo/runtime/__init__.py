"""Process plumbing of a run, no Megatron: health guards and stops, processes that die with the
trainer, what the console prints, the checkpoint folder's layout and the run's seeds."""
