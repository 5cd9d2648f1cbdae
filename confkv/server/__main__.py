"""`python -m confkv.server`: start the server (flags as `conf-kv --help`)."""

from confkv.server.main import main

main()
