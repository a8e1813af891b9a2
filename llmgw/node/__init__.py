"""`llmgw node`: the agent that runs replicas on one machine.

It is level-triggered. Every heartbeat it tells the control plane its capacity and the state of
each replica it runs, and the answer is the complete list of replicas it should run: it starts
what is missing and stops what is no longer listed. A lost message therefore changes nothing,
and a restarted agent converges on the next answer.

Each wanted replica gets a worker thread (the heartbeat loop never waits on one) that fetches
the weights and adapters into a content-addressed cache, checks the adapters against the model
(to say which one is wrong and why, before any engine loads it), starts the engine (llama.cpp's
llama-server, see llmgw.engine) and watches it: an engine that exits or stops answering /health
fails its replica, with the reason, and the control plane replaces it.

Engines run in their own session and outlive the agent: on start the agent adopts the engines
an earlier agent left running (recorded in ``<cache>/replicas/<id>/state.json``), so an agent
upgrade or crash does not reload every model. What the control plane no longer wants is
stopped after the first answer.

The modules, in the order a heartbeat meets them:

    spec      what the control plane asks for: its answer, parsed and checked
    config    the agent's settings (NodeConfig) and their defaults
    cache     the blob cache: verified downloads, named by sha256, evicted least recently used
    replica   one replica: its worker thread, its engine, what the heartbeat reports of it
    agent     the heartbeat loop: reconciling replicas with the answer, adopting engines
    cli       `llmgw node`'s options, and the start

Cache layout::

    <cache>/agent.lock               one agent per cache (flock; holds the agent's pid)
    <cache>/blobs/<sha256>           verified files, named by their content's sha256
    <cache>/tmp/                     downloads in progress; emptied when an agent starts
    <cache>/urls.json                source URL -> sha256, for sources given without a sha256
    <cache>/replicas/<id>/state.json the replica's spec, engine pid, port, command, state
    <cache>/replicas/<id>/engine.log the engine's stdout and stderr

This package must not import Django.
"""
