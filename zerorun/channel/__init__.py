"""The rank <-> launcher channel: the one protocol both sides share (Contract 3).

Ranks write to it (the shim, the runtime, user scripts through `zerorun.channel.events`); the
launcher's node runners read it (`launch/local.py`). It is its own package so that neither side
imports the other: `runtime/` never imports `launch/`, `launch/` never imports `runtime/`, and
both import this. Stdlib only, and this file imports nothing, so a rank pays nothing for it.
"""
