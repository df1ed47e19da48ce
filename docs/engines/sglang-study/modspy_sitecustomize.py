import os, sys, threading, time
def _dump():
    while True:
        time.sleep(5)
        try:
            mods = sorted({m.split(".")[0] for m in list(sys.modules)})
            with open(f"/tmp/sgl-study/modspy/mods.{os.getpid()}", "w") as f:
                f.write("\n".join(mods))
        except Exception:
            pass
threading.Thread(target=_dump, daemon=True).start()
