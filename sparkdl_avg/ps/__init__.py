"""The asynchronous parameter server: update rules (`rules`), the staleness gates
(`staleness`), its settings (`settings`), the server and a client (`server`, `client`), the
child process a fit starts (`sidecar`) and the command line (`cli`). Nothing here imports
torch or pyspark."""
