"""The compiled extension: loading and registering its targets, the CPU instruction set, the
ffi_call wrappers with their partitioning rules, and the one choice between kernel and reference."""
