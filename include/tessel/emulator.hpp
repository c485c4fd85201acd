// tessel/emulator.hpp: the UBL128 cluster emulator — cards that run tile programs for real and
// hold real bytes, a discrete-event model of the switch fabric (planes, ports, contention,
// shaping, routing, faults, scale-out), Chrome-trace timelines and SVG plots.
//
//   tessel::emu::cluster_config cfg;                 // UBL128 defaults; or load_cluster_config(path)
//   tessel::emu::cluster cl(cfg);                    // 128 cards, 8 planes x 50 GB/s each
//   void* a = cl[0].allocate(n); void* b = cl[5].allocate(n);
//   cl[0].launch(grid{...}, program);                // runs on host threads, charges roofline time
//   auto c = cl.put(0, a, 5, b, n); c.wait();        // bytes copied, time from the fabric model
//   cl.write_trace("run.json");                      // open in ui.perfetto.dev (set cfg.trace)
//
// Timing-only studies use emu::fabric directly (post/run, no payload). The data-plane contract
// that collectives build on is documented at the top of tessel/emulator/cluster.hpp.
#pragma once
#include <tessel/emulator/card.hpp>
#include <tessel/emulator/cluster.hpp>
#include <tessel/emulator/comm_model.hpp>
#include <tessel/emulator/config.hpp>
#include <tessel/emulator/errors.hpp>
#include <tessel/emulator/fabric.hpp>
#include <tessel/emulator/plot.hpp>
#include <tessel/emulator/routing.hpp>
#include <tessel/emulator/trace.hpp>
