"""How a benchmark measures and reports: machine limits, roofline, step log, stats, figures, busy
neighbours."""
