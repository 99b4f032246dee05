"""What mixprec builds on its own public parts: the bench, the doctor, the demo's run, the plots.

The command line (:mod:`mixprec.cli`) is their face; nothing below imports them.
"""
