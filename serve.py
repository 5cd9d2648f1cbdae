"""Start the CONF-KV server from a checkout: `python serve.py --help` (the same as `conf-kv --help`)."""

from confkv.server.main import main

if __name__ == "__main__":
    main()
