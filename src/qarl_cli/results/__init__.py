"""What runs leave behind, read back: a run directory's records (runs), its curves (plot), the comparison of
several runs or a sweep's jobs (summary, summary_plot), the end-of-sweep hook (sweep) and the `qarl plot` and
`qarl compare` commands (cli). Nothing here imports torch; matplotlib only where a figure is drawn."""
