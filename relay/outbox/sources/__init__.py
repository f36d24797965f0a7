"""Where the relay's batches come from: the queue (claim pending rows) or the log (cursors in commit
order). `base` has the seam (BatchSource, Page, the records both read), `queue` and `log` the two sources,
`choice` which one a relay reads from; the daemon knows only BatchSource."""
