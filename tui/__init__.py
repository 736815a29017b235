"""kvscope.tui."""
