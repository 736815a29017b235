"""The engines' KV-event protocol (vLLM, SGLang): decode, record, check, draw and publish it.

wire.py decodes and encodes frames and payloads; streamfile.py is the recorded-stream file;
recorder.py subscribes and records (`kvscope events record`); checker.py checks a stream's
invariants (`kvscope events check`); timeline.py and report.py draw a recorded stream;
publisher.py publishes a kvscope pool's own block lifecycle. docs/EVENTS.md says it all.
"""
