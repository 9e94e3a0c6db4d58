"""What the entry point checks before it builds the model (every problem at once, each with what,
why and how to fix) and the output folder it prepares."""
