import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # eval/peer: stio, peerkv, qvg_peer, qvg_cache, qvg_codec
sys.path.insert(0, HERE)                    # fakes
