"""What XLA compiled: collectives, GEMMs and the GPU scheduler's order read from a compiled
program, that order replayed, and the scheduler given prices put right."""
