"""`gpuctl dashboard`: a web UI over the state the CLI reads (clusters, jobs, managed jobs, health,
cost), with live logs and the CLI's own actions. readmodel.py reads, app.py serves, security.py
guards, commands.py acts, serve.py binds and prints the URL."""
