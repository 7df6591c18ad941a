"""Starting and supervising jobs: hosts, plan, local and SSH node runners, console.

Imports nothing, so `import zerorun.launch.events` from a rank stays cheap."""
