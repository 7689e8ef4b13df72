"""One save or one load: the public calls behind the facade (``save``/``load``, the
Accelerate bridge, attach mode, async saves, the resume fingerprint), through the hooks to
the engine. One line per module: docs/design-notes.md, "Module layout"; call sequences:
"The map" and "Where a save and a load live".
"""
