"""Storage formats shared by the kernels and the tier engine, below both: the k-bit codec's
packed tensors and their PyTorch reference (:mod:`.codecs`), and the TriZone layout the decode
kernel reads, with its torch builder (:mod:`.layout`). Imports only torch."""
