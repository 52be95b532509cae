"""Prometheus for deployctl's deployments (issue #36): scrape targets, thresholds and alert rules
(pure, from the plan), and the validated, atomic write of a Prometheus configuration folder.
docs/monitoring.md says what each file holds and how to point a Prometheus at it."""
