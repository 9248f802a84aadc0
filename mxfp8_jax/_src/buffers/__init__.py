"""Flat sharded buffers: the layout and placement metadata, DBuffer and QuantizedDBuffer, the
device-to-device moves between logical tensors and flat buffers, and logical checkpoints."""
