"""Fairness policies: which flow of a priority band is served next (GIE ``FairnessPolicy``)."""
