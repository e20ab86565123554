"""The training product: recipes resolved and checked, the training loop, metrics, profiling, packed-against-padded
comparison. Built on :mod:`thdpack.megatron` and :mod:`thdpack.data`."""
