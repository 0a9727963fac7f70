"""The worked example behind `paritykit demo`: a research model, a diffusers port with a real-world bug, the
fix.

The bug is modelled on a real port: the research code has two knobs, a connection strength between the base
and control branches (0.95) and a time-embedding mixture weight (1.0); the port folded both into one
``control_scale`` (0.95). Nothing crashes, shapes agree, and the outputs drift.
"""
