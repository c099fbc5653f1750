"""Remote attention offload for Hugging Face transformers: the attention implementation "chunkattn".

Install with ``pip install 'chunkattn-client[hf]'`` (adds torch and transformers; the rest of the client
never imports them). The model keeps its weights and runs everything but attention; each layer's
attention, and the KV it needs, lives on a chunkattn server started with the model's shape
(``chunkattn-server --hf-config config.json``)::

    with ChunkAttnClient("localhost:50051") as client, OffloadSession(client, model) as session:
        result = session.generate([prompt_a, prompt_b], max_new_tokens=64)

How a forward maps to the server: each batch row is a sequence of its own on the server (ids
``<session prefix>-<row>``), and rows may bring different numbers of new tokens: the model sees them
padded at the end, but only each row's real tokens go to the server (no padding is sent, nothing is
padded on the left), and padded positions get zeros. The model runs with ``use_cache=False`` and
explicit ``position_ids``: the server holds the KV, so each forward sends only the new tokens' q/k/v,
one Attend call per layer, unary or over one AttendStream per session.

Llama 4's NoPE layers scale queries by a factor of the position ("attention temperature tuning"). Without
a transformers cache the model computes it from position 0 in every forward; the attention function
corrects it to the true positions (it changes nothing below ``floor_scale - 1``, 8191 by default).

Modules: ``attention`` (the function transformers calls, its registration, and Llama 4's query correction),
``session`` (OffloadSession: the server's check, the rows' sequences and positions, each layer's calls under
the message limit and the work bound (``chunkattn_client.split``), forward, truncate, generate) and
``generate`` (greedy decoding, the Generation result, and the same generation by transformers alone). This
package is the only part of the client that imports torch and transformers.
"""

from __future__ import annotations

from chunkattn_client.hf.attention import NAME as NAME
from chunkattn_client.hf.attention import UNSUPPORTED as UNSUPPORTED
from chunkattn_client.hf.attention import SessionError as SessionError
from chunkattn_client.hf.generate import Generation as Generation
from chunkattn_client.hf.generate import generate_locally as generate_locally
from chunkattn_client.hf.generate import greedy as greedy
from chunkattn_client.hf.session import OffloadSession as OffloadSession
from chunkattn_client.hf.session import Transport as Transport
from chunkattn_client.split import MESSAGE_HEADROOM as MESSAGE_HEADROOM
