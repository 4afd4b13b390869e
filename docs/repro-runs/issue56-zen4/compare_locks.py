import yaml, sys
a = yaml.safe_load(open(sys.argv[1]))["stages"]; b = yaml.safe_load(open(sys.argv[2]))["stages"]
def outs(st):
    return {o["path"]: o.get("md5") or o.get("hash") for s in st.values() for o in s.get("outs", [])}
oa, ob = outs(a), outs(b)
for p in sorted(set(oa) | set(ob)):
    print(("same     " if oa.get(p) == ob.get(p) else "DIFFERENT"), p, oa.get(p), ob.get(p))
