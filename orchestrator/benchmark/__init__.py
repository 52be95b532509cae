"""`deployctl bench`: streaming load generator (loadgen), figures and verdicts (report), rendering, plots."""
