"""Launching jobs: hosts, plan, runners, supervisor, console. Imports nothing; the channel the
ranks write to is `zerorun.channel`, not part of this package."""
