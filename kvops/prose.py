"""The prose every benchmark and the load generator read, so that they all read the same text:
`kvops bench`'s mixed workload samples its prompts from it and `kvops bench kv-quant` scores perplexity
on it (`kvops.bench`), and the load generator builds its prompts from its sentences
(`kvops.loadgen.prompts`). A module of its own, below both: the load generator must not import the
benchmarks, which run it."""

from __future__ import annotations

# Plain prose (written for this benchmark) that the mixed workload's prompts are sampled from,
# sentence by sentence, with a seeded generator.
PROSE = """\
The harbour town woke slowly, with gulls circling the fish market before the first boats came in.
Mara kept the lighthouse log in a green notebook, writing the wind, the tide and every ship she saw.
A storage engineer once told me that most outages begin with a disk that nobody was watching.
The recipe calls for two cups of flour, a pinch of salt, and butter cold enough to crack.
In the spring the river rises over the low meadow and the herons stand in the flooded grass.
Caching works because programs tend to reuse the data they touched a moment ago.
The committee met on Thursday and agreed to postpone the vote until the budget was clearer.
Old maps of the valley show a mill where the car park stands today.
He tuned the violin by ear, then played a slow air that his grandmother used to hum.
Every request that arrives at the server is queued, scheduled, and answered in turn.
The desert at night is colder than most travellers expect, so they pack wool as well as linen.
Our team measured latency at the ninety-ninth percentile, because averages hide the slow tail.
A good bicycle chain needs a little oil, a clean rag, and patience on a quiet afternoon.
The museum's new wing holds ceramics from the coast, glazed in blues that look like deep water.
When memory runs short the operating system starts to swap, and everything slows to a crawl.
Children in the village learned to read from the same worn books their parents had used.
The forecast promised rain, but the afternoon stayed bright and the washing dried on the line.
Photosynthesis turns light, water and carbon dioxide into sugar and the oxygen we breathe.
She wrote the letter three times before she was happy with the opening sentence.
The train left the city at dawn and reached the mountains by the middle of the morning.
A block of memory is only useful if someone remembers who owns it and when it can be freed.
Bees return to the hive and dance to tell the others where the flowers are.
The library stays open late during exams, and the reading room fills with quiet students.
Good documentation answers the question the reader actually has, not the one the author imagined.
At the edge of the forest the path forks, and the left branch climbs toward the ridge.
The bakery sells out of rye loaves before nine, so regular customers arrive early.
Engineers argue about block sizes the way sailors argue about knots, with conviction and little data.
A thunderstorm rolled in from the west and the streetlights came on in the middle of the afternoon.
The old clock in the hall gained a minute every week, and nobody ever corrected it.
Compression saves space, but every byte saved must be paid for with time to decode it.
Farmers along the coast plant windbreaks of pine to protect the young crops from salt spray.
The conference talk ran long, and the questions at the end were better than the slides.
Tea grown on high slopes ripens slowly in the cool air and tastes lighter than lowland tea.
He fixed the leaking tap with a new washer and felt unreasonably proud for the rest of the day.
A scheduler that never says no will eventually say yes to more work than it can finish.
The island has one road, two shops, and a ferry that runs when the weather allows.
Starlings gather over the marsh in winter and move like smoke against the evening sky.
The report recommends smaller batches, better monitoring, and a clear owner for each alarm.
In the workshop the smell of sawdust and linseed oil hangs in the air long after the saws stop.
Most people remember the melody of a song long after they have forgotten the words.
"""
SENTENCES = [line.strip() for line in PROSE.splitlines() if line.strip()]
