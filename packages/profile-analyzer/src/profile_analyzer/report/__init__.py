"""Renderers of one :class:`~profile_analyzer.report.model.Report`: text (rich), json, markdown, html."""
