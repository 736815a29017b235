"""kvscope.allocator."""
