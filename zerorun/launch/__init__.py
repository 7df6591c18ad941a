"""Launching jobs: hosts, plan, runners, supervisor, console. Imports nothing, so that
`import zerorun.launch.events` from a rank stays cheap."""
