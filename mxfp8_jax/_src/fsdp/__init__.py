"""FSDP for Flax models: which parameter becomes what (the plan, from a traced loss), the unit
GEMMs that gather their planes, the step that evaluates the loss over the shards, checkpoints,
and the Flax layers and FSDP class."""
