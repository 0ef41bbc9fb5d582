import sys,collections,statistics
d=collections.defaultdict(list)
for f in sys.argv[1:]:
    for l in open(f):
        p=l.split()
        if len(p)!=5: continue
        c,s,dv,x,t=p; st='far' if float(x)>300 else 'near'
        d[(c,s,st,dv)].append(float(t))
keys=sorted({k[:3] for k in d})
for k in keys:
    print(' '.join(k), ' | '.join('div%s n=%d med %.0f' % (dv, len(d[k+(dv,)]), statistics.median(d[k+(dv,)])) for dv in ['1','2','4','old','new'] if d.get(k+(dv,))))
