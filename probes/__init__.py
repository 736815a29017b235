"""kvscope.probes."""
