"""The jax plumbing every floor uses: the eager-or-traced choice, argument checks, shard_map
and its axis groups, varying-axes types."""
