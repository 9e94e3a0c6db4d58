"""The trainer's side of the loop: the policy stages (old and reference log-probs, advantages, the
update, the supervised warm-up) and what a run sets up and checkpoints. The training engine is
an argument; its type is imported only for type checking, so these modules load no Megatron."""
