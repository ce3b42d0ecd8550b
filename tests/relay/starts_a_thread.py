"""Imported by a fork server in tests/relay/test_fork_server.py: leaves a thread running."""

import threading
import time

threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
