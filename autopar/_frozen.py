"""Imported last in the server rank processes are forked from (``autopar.launch``): what the
preloaded imports made is moved out of the garbage collector's generations, so a rank's full
collections (compile runs one) do not walk it, nor write to the pages it shares with the server."""
import gc

gc.collect()
gc.freeze()
