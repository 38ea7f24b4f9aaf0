"""kit_prices: what a model call costs in US dollars, from genai-prices' bundled data (offline).

Owns: ``model_usd`` (a model call's estimated USD, or None for a model no table holds), the
models known to have no price and the flat rates read off genai-prices once per model.
kit_agents prices each model call it records, and its warm-up, through it.

Must never: guess a price (from a bare name a local model may share with a hosted one) or
hand-write a price table, touch the network, a store or the Runtime, import a kit module above
``kit_scripted`` (whose default model name has no price), or import genai-prices at import (its
table takes ~0.1 s to load: only a model it may hold pays it).

Theory of operation: the first call of a (model, server URL) asks genai-prices; a model it does
not know is remembered as unpriced, and one priced at a flat rate has that rate derived from four
of genai-prices' own answers, so each later call is exact Decimal arithmetic (~2 us) instead of
its general calculation (0.1-0.3 ms); tiered or dated prices take the full calculation each call.
"""
from __future__ import annotations

from typing import Any

from kit_scripted import DEFAULT_NAME as SCRIPTED_NAME

__all__ = ("model_usd",)

#: (model, server URL) pairs genai-prices has no price for; the first is known without loading
#: its table (0.1 s).
_UNPRICED: set[tuple[str, str | None]] = {(SCRIPTED_NAME, None)}
#: (model, server URL) -> USD (per call, per uncached input token, per cached input token, per
#: output token), for a model whose price is one flat rate (no tiers, no dated or timed
#: prices): genai-prices' general calculation costs 0.1-0.3 ms, on every model call; a flat rate
#: is linear in the tokens, so four of its own answers give the rates, and each call after is
#: exact Decimal arithmetic on them.
_RATES: dict[tuple[str, str | None], tuple[Any, Any, Any, Any]] = {}


def model_usd(model: str, input_tokens: int, output_tokens: int, cached_tokens: int = 0,
           url: str | None = None) -> float | None:
    """Estimated USD from genai-prices' bundled data (offline); None for an unknown model.

    OpenAI's price (the SDK's own provider) when OpenAI has the model; else that of the
    provider a LiteLLM-style ``provider/model`` names, or the one whose API ``url`` (the
    model's client's base URL: Claude or Gemini through their OpenAI-compatible servers) is.
    Never a guess from a bare name: a model served locally may share a hosted one's.

    ``input_tokens`` counts every input token, ``cached_tokens`` of them read from the
    provider's prompt cache (OpenAI's ``cached_tokens``), which costs a fraction of the rest
    (a tenth for gpt-5): an agent's turns resend the conversation, so most of a long one's
    input is cached."""
    key = (model, url)
    if key in _UNPRICED:
        return None
    cached_tokens = min(max(cached_tokens, 0), input_tokens)
    if (rates := _RATES.get(key)) is not None:
        per_call, per_input, per_cached, per_output = rates
        return float(per_call + per_input * (input_tokens - cached_tokens)
                     + per_cached * cached_tokens + per_output * output_tokens)
    from genai_prices import Usage as PriceUsage, calc_price, types

    def total(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> Any:
        return calc_price(PriceUsage(input_tokens=input_tokens, output_tokens=output_tokens,
                                     cache_read_tokens=cached_tokens or None),
                          model_ref=ref, provider_id=provider, provider_api_url=api)
    head, _, tail = model.partition("/")
    for provider, ref, api in (("openai", model, None), (head, tail, None), (None, model, url)):
        try:
            price = total(input_tokens, output_tokens, cached_tokens) if ref and (
                provider or api) else None
        except LookupError:
            price = None
        if price is not None:
            break
    else:
        _UNPRICED.add(key)
        return None
    prices = price.model.prices
    if isinstance(prices, types.ModelPrice) and not any(
            isinstance(p, types.TieredPrices) for p in vars(prices).values()):
        per_call, m = total(0, 0).total_price, 1_000_000
        _RATES[key] = (per_call, (total(m, 0).total_price - per_call) / m,
                       (total(m, 0, m).total_price - per_call) / m,
                       (total(0, m).total_price - per_call) / m)
    return float(price.total_price)
