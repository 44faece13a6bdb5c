"""kvslim's own CPU kernels: a C++ extension built on first use (extension.py), each kernel with
its packing, its torch.compile fake and a plain-torch reference of its arithmetic."""
