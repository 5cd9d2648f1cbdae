"""KV memory: the arena and block pools, block tables, storage codecs, and the attention kernels that read them."""
