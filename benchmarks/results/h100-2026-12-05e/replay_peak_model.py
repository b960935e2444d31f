"""Replays the budget frontiers of this run (and others) under the memory plan's peak model and a position-aware one
(README: "What the search cannot see"). Usage: python replay_peak_model.py budget-*.json ..."""
import json,sys,glob
def replay(path, staging_per_tok_layer=None):
    d=json.load(open(path)); c=d['config']
    lc=c['layer_costs']
    if len(lc)!=1: print(path,'kinds',list(lc)); 
    kinds=list(lc)
    base=c['predicted_smallest_peak_bytes']
    # staging: from keep-all prediction
    kc=lc[kinds[0]]['held_bytes']
    n=c['num_layers']
    staging = base + n*kc['keep'] - c['predicted_keep_all_peak_bytes'] if len(kinds)==1 else None
    worst=max(lc[k]['held_bytes']['keep'] for k in kinds)
    print(path.split('results/')[1], 'staging', staging)
    for v in d['variants']:
        t=v.get('toggles',{}); plan=t.get('plan')
        if not plan or 'peak_mem_bytes' not in v or v.get('peak_mem_bytes') is None: continue
        if len(kinds)>1: continue
        h=[kc[x] for x in plan]
        old = base + sum(h) - (0 if 'offload' in plan else staging)
        H=0; m=0
        for i,x in enumerate(plan):
            m=max(m,H+kc['keep']); H+=kc[x]
        m=max(m,H)
        new = base - worst + m - (0 if 'offload' in plan else staging)
        meas=v['peak_mem_bytes']
        print(f"  {v['name'][:50]:50s} pred {t.get('predicted_peak_bytes',0)/2**30:6.2f} old {old/2**30:6.2f} new {new/2**30:6.2f} meas {meas/2**30:6.2f}  old/m {old/meas:.3f} new/m {new/meas:.3f}  {plan if len(plan)<=8 else ''}")
for p in sys.argv[1:]: replay(p)
